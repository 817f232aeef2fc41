"""Structured output: grammars that say which text may come next, and the per-request token
masks built from them (vLLM's `guided_decoding`: `json_object`, `choice`).

A grammar is a character-level automaton over immutable, hashable states:
`advance(state, text)` returns the state after `text`, or None when no completion of the
output could begin with it; `is_complete(state)` says the output may end there. The mask of a
state is the set of vocabulary tokens whose text (each token decoded alone) keeps the output
valid; it is computed once per state and cached, so a request whose state repeats (inside a
string, after a comma at the same depth) costs nothing after the first time. When the grammar
is complete only the stop tokens remain.

Plain Python (no torch): the engine turns the token ids into a mask tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MAX_WHITESPACE_RUN = 16  # consecutive whitespace characters: a model cannot pad forever
MASK_CACHE_SIZE = 1024  # grammar states whose masks are kept (a mask is one byte per token)
_WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"


class Grammar(Protocol):
    key: Hashable  # equal for grammars that accept the same text: masks are shared by it

    def initial(self) -> Hashable: ...

    def advance(self, state: Hashable, text: str) -> Hashable | None: ...

    def is_complete(self, state: Hashable) -> bool: ...


def make_grammar(guided_decoding: dict[str, Any]) -> Grammar:
    """`{"json_object": True}` or `{"choice": [...]}` (SamplingParams checked the shape)."""
    if guided_decoding.get("json_object"):
        return JSON_OBJECT
    return ChoiceGrammar(guided_decoding["choice"])


class ChoiceGrammar:
    """The output is exactly one of the given strings. A state is the text so far."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)
        self.key: Hashable = ("choice", self.choices)

    def initial(self) -> Hashable:
        return ""

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        new = f"{state}{text}"
        return new if any(c.startswith(new) for c in self.choices) else None

    def is_complete(self, state: Hashable) -> bool:
        return state in self.choices


# ---------------------------------------------------------------------------------------------
# JSON: one object at the top level (OpenAI's response_format json_object)

# A JSON state is (stack, mode, aux, whitespace run): stack holds "{" / "[" for each open
# container, mode says what may come next, aux carries the mode's detail (a string's role,
# the rest of a literal, the hex digits an escape still needs).
JsonState = tuple[tuple[str, ...], str, Any, int]


class JsonObjectGrammar:
    key: Hashable = ("json_object",)

    def initial(self) -> Hashable:
        return ((), "start", None, 0)

    def is_complete(self, state: Hashable) -> bool:
        return state[1] == "done"  # type: ignore[index]

    def advance(self, state: Hashable, text: str) -> Hashable | None:
        current: JsonState | None = state  # type: ignore[assignment]
        for char in text:
            current = _json_step(current, char)  # type: ignore[arg-type]
            if current is None:
                return None
        return current


def _json_step(state: JsonState, char: str) -> JsonState | None:
    stack, mode, aux, ws = state
    if mode in _STRUCTURAL and char in _WHITESPACE:
        return (stack, mode, aux, ws + 1) if ws < MAX_WHITESPACE_RUN else None
    state = (stack, mode, aux, 0)
    return _JSON_STEPS[mode](state, char)


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
    if char in _DIGITS:
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
    return None if ord(char) < 0x20 else state


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
    "sign": [(_DIGITS[1:], "int"), ("0", "zero")],
    "zero": [(".", "frac_start"), ("eE", "exp_start")],
    "int": [(_DIGITS, "int"), (".", "frac_start"), ("eE", "exp_start")],
    "frac_start": [(_DIGITS, "frac")],
    "frac": [(_DIGITS, "frac"), ("eE", "exp_start")],
    "exp_start": [("+-", "exp_sign"), (_DIGITS, "exp")],
    "exp_sign": [(_DIGITS, "exp")],
    "exp": [(_DIGITS, "exp")],
}
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


def _number(state: JsonState, char: str) -> JsonState | None:
    stack, _, part, _ = state
    for chars, nxt in _NUMBER_NEXT[part]:
        if char in chars:
            return (stack, "number", nxt, 0)
    if part not in _NUMBER_ENDS:
        return None
    after = (stack, "after_value", None, 0)
    return _json_step(after, char)


def _done(state: JsonState, char: str) -> JsonState | None:
    return None


JSON_OBJECT = JsonObjectGrammar()  # stateless: one for every request

_JSON_STEPS: dict[str, Callable[[JsonState, str], JsonState | None]] = {
    "start": _start, "value": _value, "value_or_end": _value_or_end, "key_or_end": _key_or_end,
    "key": _key, "colon": _colon, "after_value": _after_value, "string": _string,
    "escape": _escape, "literal": _literal, "number": _number, "done": _done,
}
# where whitespace may stand between tokens (not inside strings, numbers or literals)
_STRUCTURAL = {"start", "value", "value_or_end", "key_or_end", "key", "colon", "after_value"}


# ---------------------------------------------------------------------------------------------
# Token masks


@dataclass
class GuidedState:
    """One request's progress through its grammar."""

    grammar: Grammar
    state: Hashable
    num_tokens: int = 0  # output tokens consumed so far


class TokenMasks:
    """The allowed next tokens of grammar states over one vocabulary, as masks: bytes of the
    vocabulary's length, 1 where the token may come next.

    `token_texts[i]` is token i decoded alone; special tokens and tokens that are part of a
    multi-byte character (they decode to U+FFFD alone) are never allowed inside the output.
    """

    def __init__(
        self, token_texts: Sequence[str], special_ids: set[int], stop_ids: set[int],
        cache_size: int = MASK_CACHE_SIZE,
    ) -> None:
        self.token_texts = list(token_texts)
        self.candidates = [
            (i, text) for i, text in enumerate(self.token_texts)
            if i not in special_ids and text and "\ufffd" not in text
        ]
        self.stop_mask = _mask(len(self.token_texts), (i for i in stop_ids if i < len(self.token_texts)))
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[Hashable, Hashable], bytes] = OrderedDict()

    def allowed(self, guided: GuidedState) -> bytes:
        """The tokens that may come next: those that keep the output valid, and the stop
        tokens where the output may end."""
        key = (guided.grammar.key, guided.state)
        mask = self._cache.get(key)
        if mask is None:
            mask = self._cache[key] = self._compute(guided.grammar, guided.state)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return mask

    def _compute(self, grammar: Grammar, state: Hashable) -> bytes:
        ids = [i for i, text in self.candidates if grammar.advance(state, text) is not None]
        mask = bytearray(_mask(len(self.token_texts), ids))
        if grammar.is_complete(state):
            for i, stop in enumerate(self.stop_mask):
                mask[i] |= stop
        return bytes(mask)

    def advance(self, guided: GuidedState, output_token_ids: Sequence[int]) -> None:
        """Consume the output tokens not seen yet (one per step; all of them for a resumed
        request). A token the grammar cannot take (a stop token at the end) leaves the state."""
        for token_id in output_token_ids[guided.num_tokens :]:
            nxt = guided.grammar.advance(guided.state, self.token_texts[token_id])
            if nxt is not None:
                guided.state = nxt
        guided.num_tokens = len(output_token_ids)


def _mask(size: int, ids: Iterable[int]) -> bytes:
    mask = bytearray(size)
    for i in ids:
        mask[i] = 1
    return bytes(mask)


class GuidedDecoding:
    """The grammar state of each guided request of one engine, and the masks for a step."""

    def __init__(self, tokenizer: Any, stop_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.states: dict[str, GuidedState] = {}  # request id -> its progress
        self._masks: TokenMasks | None = None  # built at the first guided request

    def add(self, request_id: str, guided_decoding: dict[str, Any]) -> None:
        grammar = make_grammar(guided_decoding)
        self.states[request_id] = GuidedState(grammar, grammar.initial())

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def masks(self, rows: Sequence[tuple[str, Sequence[int]]]) -> list[bytes | None] | None:
        """Per row (request id, its output tokens): the tokens it may sample next, or None
        for an unguided request; None altogether when no row is guided."""
        if not any(request_id in self.states for request_id, _ in rows):
            return None
        masks = self._token_masks()
        out: list[bytes | None] = []
        for request_id, output_token_ids in rows:
            guided = self.states.get(request_id)
            if guided is not None:
                masks.advance(guided, output_token_ids)
            out.append(None if guided is None else masks.allowed(guided))
        return out

    def _token_masks(self) -> TokenMasks:
        if self._masks is None:  # every token decoded alone, once (a fraction of a second)
            size = len(self.tokenizer)
            texts = self.tokenizer.batch_decode([[i] for i in range(size)])
            self._masks = TokenMasks(texts, set(self.tokenizer.all_special_ids), self.stop_ids)
        return self._masks
