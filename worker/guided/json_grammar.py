"""The JSON grammar for guided decoding: any JSON object (OpenAI's `json_object`), and the
generic JSON automaton that schema grammars (`worker.guided.json_schema_grammar`) run inside their
strings and free-form values. Automata over hashable states that read UTF-8 one byte per
character, as `worker.guided.structured_output.Grammar` describes: JSON's structure is ASCII, and
inside strings the bytes of other characters are checked to add up to whole, well-formed
UTF-8.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

MAX_WHITESPACE_RUN = 64  # consecutive whitespace: room to indent 15 levels by 4, yet no padding forever
WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
# what ends or escapes a string, may not stand in one, or (bytes of other characters) must be
# checked one by one
STRING_STOPS = re.compile(r'["\\\x00-\x1f\x80-\xff]')


# ---------------------------------------------------------------------------------------------
# JSON: one object at the top level (OpenAI's response_format json_object)

# A JSON state is (stack, mode, aux, whitespace run): stack holds "{" / "[" for each open
# container, mode says what may come next, aux carries the mode's detail (a string's role,
# the rest of a literal, the hex digits an escape still needs).
JsonState = tuple[tuple[str, ...], str, Any, int]


class JsonObjectGrammar:
    """Any JSON object; `compact` (vLLM's disable_any_whitespace): no whitespace but the one
    space after each `,` and `:`, as xgrammar writes JSON then (`{"a": [1, 2]}`)."""

    def __init__(self, compact: bool = False) -> None:
        self.compact = compact
        self.step = compact_json_step if compact else json_step
        self.key: Hashable = ("json_object", compact)

    def initial(self) -> Hashable:
        return ((), "start", None, 0)

    def is_complete(self, state: Hashable) -> bool:
        return state[1] == "done"  # type: ignore[index]

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        if state[1] == "string" and not STRING_STOPS.search(text):  # type: ignore[index]
            return state  # plain text inside a string: most tokens there, checked at once
        current: JsonState | None = state  # type: ignore[assignment]
        for char in text:
            current = self.step(current, char)  # type: ignore[arg-type]
            if current is None:
                return None
        return current


def json_step(state: JsonState, char: str) -> JsonState | None:
    stack, mode, aux, ws = state
    if mode in _STRUCTURAL and char in WHITESPACE:
        return (stack, mode, aux, ws + 1) if ws < MAX_WHITESPACE_RUN else None
    state = (stack, mode, aux, 0)
    return _JSON_STEPS[mode](state, char)


SPACE_DUE = -1  # a compact state's whitespace count: the one space after a separator comes next


def compact_json_step(state: JsonState, char: str) -> JsonState | None:
    """`json_step` for compact JSON: whitespace only as the one space each separator takes."""
    stack, mode, aux, ws = state
    if ws == SPACE_DUE:
        return (stack, mode, aux, 0) if char == " " else None
    if char in WHITESPACE and mode != "string":  # (a number's end too: no space before what follows)
        return None
    new = _JSON_STEPS[mode](state, char)
    if new is not None and char in ",:" and new[1] in ("key", "value"):  # a separator: its space is due
        return (*new[:3], SPACE_DUE)
    return new


def _start(state: JsonState, char: str) -> JsonState | None:
    return (("{",), "key_or_end", None, 0) if char == "{" else None


def _value(state: JsonState, char: str) -> JsonState | None:
    """The first character of a value."""
    stack = state[0]
    if char == "{":
        return ((*stack, "{"), "key_or_end", None, 0)
    if char == "[":
        return ((*stack, "["), "value_or_end", None, 0)
    if char == '"':
        return (stack, "string", "value", 0)
    if char == "-":
        return (stack, "number", "sign", 0)
    if char == "0":
        return (stack, "number", "zero", 0)
    if char in DIGITS:
        return (stack, "number", "int", 0)
    for literal in ("true", "false", "null"):
        if char == literal[0]:
            return (stack, "literal", literal[1:], 0)
    return None


def _value_or_end(state: JsonState, char: str) -> JsonState | None:
    return _close(state, char) if char == "]" else _value(state, char)


def _key_or_end(state: JsonState, char: str) -> JsonState | None:
    return _close(state, char) if char == "}" else _key(state, char)


def _key(state: JsonState, char: str) -> JsonState | None:
    return (state[0], "string", "key", 0) if char == '"' else None


def _colon(state: JsonState, char: str) -> JsonState | None:
    return (state[0], "value", None, 0) if char == ":" else None


def _after_value(state: JsonState, char: str) -> JsonState | None:
    stack = state[0]
    if char == ",":
        return (stack, "key" if stack[-1] == "{" else "value", None, 0)
    return _close(state, char)


def _close(state: JsonState, char: str) -> JsonState | None:
    stack = state[0]
    if not stack or char != {"{": "}", "[": "]"}[stack[-1]]:
        return None
    rest = stack[:-1]
    return (rest, "after_value" if rest else "done", None, 0)


def _string(state: JsonState, char: str) -> JsonState | None:
    stack, _, role, _ = state
    if char == '"':
        return (stack, "colon" if role == "key" else "after_value", None, 0)
    if char == "\\":
        return (stack, "escape", (role, 0), 0)
    code = ord(char)
    if code < 0x80:
        return None if code < 0x20 else state
    more = _UTF8_CONTINUATIONS.get(code >> 4) if code >= 0xC2 and code <= 0xF4 else None
    return None if more is None else (stack, "utf8", (role, more), 0)


_UTF8_CONTINUATIONS = {0xC: 1, 0xD: 1, 0xE: 2, 0xF: 3}  # by a lead byte's high four bits


def _utf8(state: JsonState, char: str) -> JsonState | None:
    """The continuation bytes of a character begun in a string."""
    stack, _, (role, left), _ = state
    if not 0x80 <= ord(char) <= 0xBF:
        return None
    return (stack, "utf8", (role, left - 1), 0) if left > 1 else (stack, "string", role, 0)


def _escape(state: JsonState, char: str) -> JsonState | None:
    stack, _, (role, hex_left), _ = state
    if hex_left:
        if char not in _HEX:
            return None
        return (stack, "escape", (role, hex_left - 1), 0) if hex_left > 1 else (stack, "string", role, 0)
    if char not in _ESCAPES:
        return None
    return (stack, "escape", (role, 4), 0) if char == "u" else (stack, "string", role, 0)


def _literal(state: JsonState, char: str) -> JsonState | None:
    stack, _, rest, _ = state
    if char != rest[0]:
        return None
    return (stack, "literal", rest[1:], 0) if len(rest) > 1 else (stack, "after_value", None, 0)


# What may follow each part of a number: the next part, or (the number ended) whatever may
# follow a value.
_NUMBER_NEXT: dict[str, list[tuple[str, str]]] = {
    "sign": [(DIGITS[1:], "int"), ("0", "zero")],
    "zero": [(".", "frac_start"), ("eE", "exp_start")],
    "int": [(DIGITS, "int"), (".", "frac_start"), ("eE", "exp_start")],
    "frac_start": [(DIGITS, "frac")],
    "frac": [(DIGITS, "frac"), ("eE", "exp_start")],
    "exp_start": [("+-", "exp_sign"), (DIGITS, "exp")],
    "exp_sign": [(DIGITS, "exp")],
    "exp": [(DIGITS, "exp")],
}
NUMBER_ENDS = {"zero", "int", "frac", "exp"}


def number_next(part: str, char: str, integer: bool = False) -> str | None:
    """The part of a number `char` continues it with; None when it does not."""
    for chars, nxt in _NUMBER_NEXT[part]:
        if char in chars and not (integer and nxt in ("frac_start", "exp_start")):
            return nxt
    return None


def _number(state: JsonState, char: str) -> JsonState | None:
    stack, _, part, _ = state
    nxt = number_next(part, char)
    if nxt is not None:
        return (stack, "number", nxt, 0)
    if part not in NUMBER_ENDS:
        return None
    after = (stack, "after_value", None, 0)
    return json_step(after, char)  # (a compact step marks the space a separator here makes due)


def _done(state: JsonState, char: str) -> JsonState | None:
    return None


JSON_OBJECT = JsonObjectGrammar()  # stateless: one for every request
COMPACT_JSON_OBJECT = JsonObjectGrammar(compact=True)

_JSON_STEPS: dict[str, Callable[[JsonState, str], JsonState | None]] = {
    "start": _start, "value": _value, "value_or_end": _value_or_end, "key_or_end": _key_or_end,
    "key": _key, "colon": _colon, "after_value": _after_value, "string": _string,
    "escape": _escape, "literal": _literal, "number": _number, "done": _done, "utf8": _utf8,
}
# where whitespace may stand between tokens (not inside strings, numbers or literals)
_STRUCTURAL = {"start", "value", "value_or_end", "key_or_end", "key", "colon", "after_value"}
